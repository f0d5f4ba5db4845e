"""The served APIs: the OpenAI-compatible routes and the ollama ones over one shared request layer."""
