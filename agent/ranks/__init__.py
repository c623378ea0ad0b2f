"""The life of each rank on the node: started from the launcher's request, followed until it ended, stopped
with its signals, adopted by the next agent, its folder kept for debug sessions or removed (J15)."""
