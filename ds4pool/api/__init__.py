"""The HTTP face: OpenAI- and Anthropic-compatible routes, sessions, admin, health."""
