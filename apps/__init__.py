"""mirrorsd.apps: the programs built on the SDK: the command line (cli.py), the OpenAI and ollama server (serve/), the
chat app (chat/), the benchmark (bench/) and the vLLM handoff (handoff/)."""
