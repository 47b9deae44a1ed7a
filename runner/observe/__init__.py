"""What a server, a scheduler or an exporter says, read into facts: bounded HTTP answers, text made inert,
memory figures validated, failures classified, PyTorch's OOM message and traceback taken apart. Pure but for
`bounded`; below the kinds, which all read their servers through it."""
