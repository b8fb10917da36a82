"""The denoiser and its objective: the narrowed SANA DiT with a REPA head (dit.py) and flow matching, loss and Euler/CFG sampler (flow.py)."""
