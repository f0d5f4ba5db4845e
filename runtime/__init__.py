"""mirrorsd.runtime: execution. The verifier backend (torch), the drafters and the draft-verify loop."""
