"""The web console: the seed's flows as pages, each acting as the signed-in user."""
