"""The two-queue pipeline: a draft worker that drafts ahead while the target verifies ("overlap", "branches")."""
