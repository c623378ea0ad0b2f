"""Autoscaler service: demand per queue and flavor (A1, A6); providers come later."""
