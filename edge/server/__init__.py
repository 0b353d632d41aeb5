"""edge-serve: an OpenAI-compatible HTTP server over one engine (`edge.server.app`)."""
