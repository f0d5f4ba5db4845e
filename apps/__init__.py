"""mirrorsd.apps: the programs built on the SDK (benchmark script; chat app and server to come)."""
