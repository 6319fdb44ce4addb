"""Pagoda's OpenAI-compatible HTTP server (aiohttp on uvloop); see docs/server.md."""
