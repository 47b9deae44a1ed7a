"""A Plan → records on disk: the executor, the session policy, each step's sends and record, the run folder,
what is left to do, signals and locks. The side effects of a run live here."""
