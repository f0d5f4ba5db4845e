"""The decode loop. loop.py runs a request's steps (run_plan); verify.py is one verify step (DecodeState) and the
accept rule (verify), with the sampling arithmetic (sampling.py) and the grammar clip (grammar.py) beside it;
drafting.py guards a drafter's calls; plan.py fixes a request's mode and placement. policy/ decides how much to
draft, pipeline/ drafts ahead on another thread."""
