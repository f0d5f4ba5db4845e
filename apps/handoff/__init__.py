"""`mirrorsd handoff`: the folder that takes a measured drafter to vLLM (folder.py), and mirrorsd's model-free
drafters as the vLLM proposers that folder names (vllm_proposer.py). The proposers run inside vLLM's environment,
where mirrorsd is installed without its dependencies, so this package imports nothing itself."""
