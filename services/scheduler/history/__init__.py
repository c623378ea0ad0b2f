"""The scheduler's past: its state at a past instant, rebuilt from the events recorded up to it (past.py), the
snapshots that save such states for later views (past_snapshots.py) and for a start (start_snapshots.py), and
recorded history replayed on a changed cluster (whatif.py, `trainyard simulate`). None of it touches the live state.
"""
