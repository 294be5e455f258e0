"""Serving: the client SDK, the privacy proxy, the local server and their shared OpenAI HTTP scaffold (layer 4)."""
