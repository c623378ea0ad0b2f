"""The scheduler's decisions, as pure functions of its state and a message (or `now`, never a clock read): they
return the events to record and never talk to anyone; the service records them.

- reactions.py: what it records in answer to the monitor's, the launcher's and the autoscaler's events;
- cycle.py: what a scheduling cycle records: expirations, settled failures, admissions and growths;
- predicted.py: the predictions of accepted jobs, once they are planned;
- submissions.py: what a batch of submissions records (`decide`), and the group commit that gathers the batches.
"""
