#!/usr/bin/env bash
# Pack $OUT for a remote machine that returns only a few files per command: every file under
# $OUT goes into $OUT/out.tgz (paths kept), and the small text summaries named by KEEP (globs
# relative to $OUT, default: *.md and *.log at its top) stay beside it, readable at once.
# Run it as the last step of a command:   ...; bash experiments/gpu/pack.sh
set -uo pipefail
: "${OUT:?set OUT}"
cd "$OUT" || exit 1
keep=${KEEP:-"*.md *.log"}
tar czf /tmp/out.$$.tgz --exclude=./out.tgz . || exit 1
shopt -s nullglob
declare -A stay=()
for pattern in $keep; do for f in $pattern; do [ -f "$f" ] && stay[$f]=1; done; done
find . -mindepth 1 -maxdepth 1 | while read -r entry; do
  name=${entry#./}
  [ -n "${stay[$name]+x}" ] || rm -rf -- "$entry"
done
mv /tmp/out.$$.tgz out.tgz
ls -la "$OUT"
