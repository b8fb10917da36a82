# flowmatch's image: the code server (dagster api grpc), the CLI and training, for the workers of
# docs/scaling-out.md and the Helm values (deploy/k8s/values.yaml). No data and no weights inside:
# the data root is the volume /data (or FLOWMATCH_REMOTE's cache), the encoders load from their
# hub ids or folders at run time.
#
#   podman build -t flowmatch .                          # CPU torch (docker build works the same)
#   podman build --build-arg TORCH=cuda -t flowmatch .   # CUDA torch, for GPU workers
#   podman run --rm flowmatch flowmatch --help
ARG BASE=python:3.11-slim
FROM ${BASE}

# cpu: the CPU build of torch from TORCH_INDEX; cuda: PyPI's default (CUDA) build
ARG TORCH=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN python3 -m venv /opt/venv
# torch first, chosen by TORCH (as scripts/install.sh chooses it on a machine)
RUN if [ "$TORCH" = cpu ]; then \
      pip install "torch==${TORCH_VERSION}" ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"}; \
    else \
      pip install "torch==${TORCH_VERSION}"; \
    fi

# the project, editable in /app: the code finds configs/, workspace.yaml and docs/benchmarks/
# beside its packages, as in a checkout
WORKDIR /app
COPY pyproject.toml README.md workspace.yaml ./
COPY flowmatch_models flowmatch_models
COPY flowmatch_assets flowmatch_assets
COPY configs configs
COPY docs/benchmarks docs/benchmarks
# (neardup: scipy, which no other dependency of the image brings)
RUN pip install -e ".[scale]" && python -c "import flowmatch_assets.definitions, flowmatch_assets.ingest.neardup"

# a user of its own; the data root is a volume; a Dagster instance of its own (sqlite, telemetry
# off) until DAGSTER_HOME names a shared one (deploy/dagster.postgres.yaml, the Helm chart's)
RUN useradd --uid 1000 --create-home flowmatch && mkdir -p /data && chown flowmatch /data \
    && mkdir -p /home/flowmatch/dagster_home \
    && printf 'telemetry:\n  enabled: false\n' > /home/flowmatch/dagster_home/dagster.yaml \
    && chown -R flowmatch /home/flowmatch/dagster_home
USER flowmatch
ENV FLOWMATCH_DATA_ROOT=/data \
    DAGSTER_HOME=/home/flowmatch/dagster_home \
    HOME=/home/flowmatch
VOLUME /data
EXPOSE 3030
CMD ["flowmatch", "--help"]
