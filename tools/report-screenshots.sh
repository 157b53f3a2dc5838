#!/usr/bin/env bash
# Screenshots of `trace report` pages for docs/bug-reports.md (docs/images/report-walkthrough.png,
# docs/images/report-padded.png), taken by the Chromium test tests/report_page.rs at 1300 px: the
# README walkthrough pair (SmolLM2 Q4_1, whole prompt vs prefill chunks of 18) and a padded batch
# (the prompt alone vs between two other requests). Needs tools/fetch-models.sh and chromium.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
UPDATE_SCREENSHOTS=1 cargo test --release --test tests -- report_page::
ls -l docs/images/report-*.png
