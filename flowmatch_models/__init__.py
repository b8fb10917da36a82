"""flowmatch_models: everything that runs without Dagster, one folder per concern.

model/       the denoiser (a narrowed SANA DiT + REPA head) and flow matching (loss, sampler)
encoders/    which encoders (EncoderSpec), loading them (from_pretrained), the frozen
             encoders of the precalc, device leases, the offline zoo
embeddings/  the registry of embedding kinds (KINDS), the precalc, the shard checks
storage/     files: the .fms embedding store, its codecs, lossy and transform coding, the
             images shard, the data root's layout, fingerprints, atomic writes
data/        the training loader: epoch order, shards and row readers, the batch ring,
             device decode, the rank/worker stream, the data module, aspect-ratio buckets
train/       the Lightning module, the config, the training entry point
             (``python -m flowmatch_models.train --config run.yaml``), callbacks, the
             ledger, fine-tuning, DDP coordination, wandb
inference/   sampling a trained model, exporting a diffusers SanaPipeline
figures/     image grids and loss curves as PNG
"""
