#!/usr/bin/env bash
# The quick tier, for daily work (under a minute once built; the whole suite is
# `cargo test --release`): the unit tests of every crate, then from the integration binary the
# trace format, bad and crafted input, and one builtin-model record + bisect (whole prompt vs
# one-token prefill: an op with matched inputs named, the prefill chunk the only setting that
# differs). Needs no Python; two bad-input tests read the SmolLM2 file (tools/fetch-models.sh).
# Extra arguments go to both cargo commands' test harness (`tools/quick.sh --nocapture`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
cargo test --release --workspace --lib -- "$@"
cargo test --release --test tests -- format:: bad_input:: untrusted:: bisect_cli::builtin_prefill_chunk_diverges "$@"
