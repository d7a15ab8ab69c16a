# The stagetree image for infra/compose.yaml: `stagetree serve` (projector, scheduler) and
# `stagetree worker` (one per GPU). Build context: the repository root (compose sets it).
# Only the packages are copied: nothing under .infra/ (credentials) can enter the image;
# infra/stagetree.Dockerfile.dockerignore keeps it out of the build context as well.
FROM pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

WORKDIR /opt/stagetree
COPY pyproject.toml README.md constraints.txt ./
COPY stagetree ./stagetree
COPY events ./events
COPY projections ./projections
COPY scheduler ./scheduler
COPY gpu_worker ./gpu_worker
COPY replay ./replay
COPY examples ./examples
# The versions `make test-oldest-torch` tests: constraints.txt without what the base image's
# torch brings (torch itself, triton, the CUDA libraries, sympy, mpmath, setuptools).
RUN grep -v -E '^(torch|triton|nvidia-|sympy|mpmath|setuptools)=' constraints.txt > /tmp/constraints.txt \
    && pip install --no-cache-dir -c /tmp/constraints.txt . && useradd --create-home --uid 1000 stagetree
# Determinism recipe (DESIGN.md): deterministic cuBLAS workspaces on GPU.
ENV CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONUNBUFFERED=1
USER stagetree
WORKDIR /home/stagetree
ENTRYPOINT []
CMD ["stagetree", "--help"]
