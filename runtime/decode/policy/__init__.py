"""How much to draft: the K schedule, the speculation gate, match classes, verify costs and calibration."""
