"""matrix.toml → a Plan: the matrix declared and validated, lanes of sessions of steps, the inputs' digest,
everything checked before the first server starts, the baseline and the plan of repeats."""
