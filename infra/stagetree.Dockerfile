# The stagetree image for infra/compose.yaml: `stagetree serve` (projector, scheduler) and
# `stagetree worker` (one per GPU). Build context: the repository root (compose sets it).
# Only the packages are copied: nothing under .infra/ (credentials) can enter the image;
# infra/stagetree.Dockerfile.dockerignore keeps it out of the build context as well.
FROM pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

WORKDIR /opt/stagetree
COPY pyproject.toml README.md ./
COPY stagetree ./stagetree
COPY events ./events
COPY projections ./projections
COPY scheduler ./scheduler
COPY gpu_worker ./gpu_worker
COPY replay ./replay
COPY examples ./examples
RUN pip install --no-cache-dir . && useradd --create-home --uid 1000 stagetree
# Determinism recipe (DESIGN.md): deterministic cuBLAS workspaces on GPU.
ENV CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONUNBUFFERED=1
USER stagetree
WORKDIR /home/stagetree
ENTRYPOINT []
CMD ["stagetree", "--help"]
