#!/usr/bin/env bash
# Create bench/.venv: latchkey (editable, from this checkout), its drivers, and the peer
# libraries the benchmarks compare against. Peers are installed one by one: one that does not
# install is skipped (bench/run.py --peers then reports it as "not installed").
set -u
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-python3}
venv="$here/.venv"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv" || exit 1
"$venv/bin/python" -m pip install -q --upgrade pip >/dev/null
"$venv/bin/python" -m pip install -q -e "$here/.." || exit 1
failed=()
while read -r req; do
    req=${req%%#*}; req=$(echo "$req" | xargs)
    [ -n "$req" ] || continue
    if ! "$venv/bin/python" -m pip install -q "$req"; then
        failed+=("$req")
    fi
done < "$here/requirements.txt"
"$venv/bin/python" -m pip freeze > "$here/.venv/freeze.txt"
if [ ${#failed[@]} -gt 0 ]; then
    echo "did not install (skipped): ${failed[*]}"
fi
echo "bench venv ready: $venv"
