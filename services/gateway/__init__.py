"""The gateway: the platform over HTTP (SPEC X7), for people and for the systems around it that speak HTTP."""
