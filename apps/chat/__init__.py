"""The chat app: `mirrorsd chat` in a Qt window or a terminal, over one conversation model."""
