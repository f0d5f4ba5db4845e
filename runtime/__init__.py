"""mirrorsd.runtime: execution. The target backends, the drafters and the draft-verify loop."""
