"""Subclassed TRL trainers that run the plugins. Arrives with the trainer issue."""
