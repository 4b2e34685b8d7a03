"""The gateway's parts: the upstream pool and the server's limits."""
