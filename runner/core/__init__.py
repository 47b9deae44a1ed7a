"""What every stage shares: the declared records, the registry of kinds, the vocabularies, units, errors and
secrets. Imports nothing else of the runner."""
