"""Records → a verdict per card and the findings: images scored, peaks reconciled, the verdict's rules and
words. Pure: it reads records and writes nothing, so the run stage can ask it as it goes."""
