#!/usr/bin/env bash
# Regenerates the pasted outputs of the README and docs/batch-invariance.md (the blocks after
# `<!-- readme-output: NAME -->`) from the current binary, by running the commands they show. The test
# `readme::pasted_outputs_are_current` fails when one is stale. Needs tools/fetch-models.sh first.
# It also writes the `<!-- readme-machine: ... -->` marker: the blocks are compared exactly on a
# machine with that fingerprint (architecture, SIMD extensions, data caches, cores above 2), by
# structure elsewhere.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
UPDATE_README=1 cargo test --release --test tests readme::pasted_outputs_are_current
