"""What a person sees of a run: the console progress, the live metrics, report.md and its plots, the cost,
run.json's facts, `runner compare` and the published schemas."""
