"""Training: the Lightning module (module.py), the config (config.py), the entry point (run.py; python -m flowmatch_models.train), callbacks, the ledger, fine-tuning, DDP coordination, wandb."""
