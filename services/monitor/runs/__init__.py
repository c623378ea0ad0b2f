"""Runs (SPEC R1, R2): the life of each job's run, decided from the launcher's and the scheduler's events
(`runlife`), and the reading of its series from the metrics stream for the people who ask (`reader`)."""
