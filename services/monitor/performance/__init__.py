"""Performance detection (M6): the detector that turns iteration lines into incidents (`detector`, no I/O), and
the durable consumer that feeds it every job's log chunks as they stream (`logfeed`)."""
