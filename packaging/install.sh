#!/usr/bin/env bash
# Install the patchswarm rollout-host daemon as a systemd service (docs/daemon.md, "Running it").
#
#   sudo packaging/install.sh --root-pub ROOT.pub --cluster-secret SECRET [--enable]
#
# It creates the system user and group `patchswarm`, a virtual environment under /opt/patchswarm
# with patchswarm installed in it, /etc/patchswarm (root:patchswarm 0750) holding daemon.toml,
# root.pub and cluster.secret (0640), /var/lib/patchswarm (patchswarm, 0700), and the unit
# (/run/patchswarm comes from its RuntimeDirectory), then checks the unit with
# `systemd-analyze verify`. Running it again changes nothing an operator edited: daemon.toml is
# installed only when absent; the key, the secret and the unit are replaced when given.
#
# Options:
#   --root-pub FILE        the trust root's public key (PEM); required on a first install
#   --cluster-secret FILE  the cluster secret (at least 16 bytes); required on a first install
#   --config FILE          daemon.toml to install when none is there (default: packaging/daemon.toml)
#   --source SPEC          what pip installs into the new venv (default: this checkout)
#   --pip-args "ARGS"      extra pip arguments (e.g. "--no-index --find-links /wheels")
#   --python PY            interpreter the venv is made with (default: python3)
#   --venv DIR             use this existing environment (it must hold bin/patchswarm) instead
#                          of creating /opt/patchswarm/.venv; nothing is pip-installed
#   --prefix DIR           install into DIR as the file-system root (DESTDIR-like: users go into
#                          DIR/etc/passwd, nothing on this system changes; nothing is started)
#   --enable               systemctl enable --now patchswarm (only with the real root)
#   --dry-run              print what would be done, change nothing
set -euo pipefail

NAME=patchswarm
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HERE")
PREFIX=/
ROOT_PUB=
SECRET=
CONFIG=$HERE/daemon.toml
SOURCE=$REPO
PIP_ARGS=
PYTHON=python3
VENV=
ENABLE=0
DRY=0

die() { echo "install.sh: $*" >&2; exit 2; }
need_arg() { [[ $# -ge 2 && -n $2 ]] || die "$1 needs a value"; }

while [[ $# -gt 0 ]]; do
    case $1 in
        --root-pub) need_arg "$@"; ROOT_PUB=$2; shift 2 ;;
        --cluster-secret) need_arg "$@"; SECRET=$2; shift 2 ;;
        --config) need_arg "$@"; CONFIG=$2; shift 2 ;;
        --source) need_arg "$@"; SOURCE=$2; shift 2 ;;
        --pip-args) [[ $# -ge 2 ]] || die "--pip-args needs a value"; PIP_ARGS=$2; shift 2 ;;
        --python) need_arg "$@"; PYTHON=$2; shift 2 ;;
        --venv) need_arg "$@"; VENV=$2; shift 2 ;;
        --prefix) need_arg "$@"; PREFIX=$2; shift 2 ;;
        --enable) ENABLE=1; shift ;;
        --dry-run) DRY=1; shift ;;
        -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
done

# ------------------------------------------------------------ check everything before changing anything
PREFIX=${PREFIX%/}
[[ -z $PREFIX || -d $PREFIX ]] || die "--prefix: $PREFIX is not a directory"
ETC=$PREFIX/etc/$NAME
STATE=$PREFIX/var/lib/$NAME
UNIT_DIR=$PREFIX/etc/systemd/system
VENV_TARGET=${VENV:-/opt/$NAME/.venv}  # the path as the installed system sees it
[[ $EUID -eq 0 || $DRY -eq 1 ]] || die "run as root (or with --dry-run)"
[[ -n $PREFIX && $ENABLE -eq 1 ]] && die "--enable works only on the real root (no --prefix)"

regular_file() {  # FLAG FILE MAX_BYTES: a readable regular file of bounded size
    [[ -f $2 && ! -L $2 ]] || die "$1: $2 is not a regular file"
    [[ -r $2 ]] || die "$1: cannot read $2"
    local size; size=$(stat -c %s "$2")
    (( size <= $3 )) || die "$1: $2 is $size bytes; at most $3 expected"
}
if [[ -n $ROOT_PUB ]]; then
    regular_file --root-pub "$ROOT_PUB" 65536
    # The trainer's private key must never land on a rollout host by a slip of the path.
    grep -q -- "PRIVATE KEY" "$ROOT_PUB" && die "--root-pub: $ROOT_PUB holds a private key; give the public one"
    grep -q -- "-----BEGIN PUBLIC KEY-----" "$ROOT_PUB" || die "--root-pub: $ROOT_PUB is not a PEM public key"
elif [[ ! -f $ETC/root.pub ]]; then
    die "--root-pub is required (no $ETC/root.pub yet)"
fi
if [[ -n $SECRET ]]; then
    regular_file --cluster-secret "$SECRET" 65536
    secret_len=$(tr -d '[:space:]' < "$SECRET" | wc -c)
    (( secret_len >= 16 )) || die "--cluster-secret: $SECRET holds $secret_len bytes; at least 16 are needed"
elif [[ ! -f $ETC/cluster.secret ]]; then
    die "--cluster-secret is required (no $ETC/cluster.secret yet)"
fi
regular_file --config "$CONFIG" 1048576
if [[ -n $VENV ]]; then
    [[ -x $VENV/bin/$NAME ]] || die "--venv: $VENV/bin/$NAME is missing (install patchswarm there first)"
else
    command -v "$PYTHON" >/dev/null || die "--python: $PYTHON not found"
fi
UNIT_SRC=$HERE/systemd/$NAME.service
[[ -f $UNIT_SRC ]] || die "$UNIT_SRC is missing"

run() {  # a change to the system: printed under --dry-run, done otherwise
    if (( DRY )); then printf '+'; printf ' %q' "$@"; printf '\n'; else "$@"; fi
}

# ------------------------------------------------------------ user and group
ACCOUNTS=()
[[ -n $PREFIX ]] && ACCOUNTS=(--prefix "$PREFIX")
if [[ -n $PREFIX ]]; then  # an empty root gets empty account files for useradd --prefix to fill
    run mkdir -p "$PREFIX/etc"
    for f in passwd group shadow gshadow; do
        [[ -e $PREFIX/etc/$f ]] || run touch "$PREFIX/etc/$f"
    done
fi
lookup() {  # DB NAME -> its numeric id, in the target root's files
    local file=$PREFIX/etc/$1
    [[ -f $file ]] || return 0
    awk -F: -v n="$2" '$1 == n { print $3; exit }' "$file"
}
[[ -n $(lookup group $NAME) ]] || run groupadd "${ACCOUNTS[@]}" --system $NAME
[[ -n $(lookup passwd $NAME) ]] || run useradd "${ACCOUNTS[@]}" --system --gid $NAME --home-dir /var/lib/$NAME \
    --no-create-home --shell /usr/sbin/nologin --comment "patchswarm weight-sync daemon" $NAME
GID=$(lookup group $NAME); GID=${GID:-$NAME}  # a dry run on a fresh root prints the name
UID_=$(lookup passwd $NAME); UID_=${UID_:-$NAME}

# ------------------------------------------------------------ directories and files
run install -d -m 0755 -o 0 -g 0 "$PREFIX/etc" "$UNIT_DIR" "$PREFIX/opt/$NAME" "$PREFIX/usr/share/doc/$NAME"
run install -d -m 0750 -o 0 -g "$GID" "$ETC"
run install -d -m 0700 -o "$UID_" -g "$GID" "$STATE"
[[ -n $ROOT_PUB ]] && run install -m 0640 -o 0 -g "$GID" "$ROOT_PUB" "$ETC/root.pub"
[[ -n $SECRET ]] && run install -m 0640 -o 0 -g "$GID" "$SECRET" "$ETC/cluster.secret"
if [[ -e $ETC/daemon.toml ]]; then
    echo "keeping $ETC/daemon.toml"
else
    run install -m 0640 -o 0 -g "$GID" "$CONFIG" "$ETC/daemon.toml"
fi
run install -m 0644 -o 0 -g 0 "$REPO/docs/daemon.md" "$PREFIX/usr/share/doc/$NAME/daemon.md"

# ------------------------------------------------------------ the virtual environment
if [[ -z $VENV ]]; then
    if [[ ! -x $PREFIX$VENV_TARGET/bin/python ]]; then
        run "$PYTHON" -m venv "$PREFIX$VENV_TARGET"
    fi
    # shellcheck disable=SC2086 # PIP_ARGS is a list of words
    # The caller's PYTHONPATH would make pip see a checkout's metadata as "already installed".
    run env -u PYTHONPATH -u PIP_USER "$PREFIX$VENV_TARGET/bin/python" -m pip install --quiet $PIP_ARGS "$SOURCE"
fi

# ------------------------------------------------------------ the unit
UNIT=$UNIT_DIR/$NAME.service
if (( DRY )); then
    echo "+ install $UNIT_SRC as $UNIT with ExecStart=$VENV_TARGET/bin/$NAME"
else
    tmp=$(mktemp "$UNIT_DIR/.$NAME.service.XXXXXX")
    sed "s|/opt/$NAME/.venv/bin/$NAME|$VENV_TARGET/bin/$NAME|" "$UNIT_SRC" > "$tmp"
    chmod 0644 "$tmp"
    mv -f "$tmp" "$UNIT"  # atomic: systemd never reads half a unit
fi
if command -v systemd-analyze >/dev/null && (( ! DRY )); then
    # Checked as this system sees it: under --prefix the entry point lies below the prefix.
    check=$(mktemp -d)
    trap 'rm -rf "$check"' EXIT
    exe=$VENV_TARGET/bin/$NAME
    [[ -z $VENV ]] && exe=$PREFIX$exe
    sed "s|^ExecStart=$VENV_TARGET/bin/$NAME|ExecStart=$exe|" "$UNIT" > "$check/$NAME.service"
    out=$(systemd-analyze verify --man=no "$check/$NAME.service" 2>&1) || true
    if grep -q "$NAME.service" <<<"$out"; then
        echo "$out" >&2
        die "systemd-analyze verify found problems in $UNIT"
    fi
fi

if [[ -z $PREFIX ]] && [[ -d /run/systemd/system ]]; then
    run systemctl daemon-reload
    (( ENABLE )) && run systemctl enable --now $NAME
fi
if (( DRY )); then
    echo "dry run: nothing was changed"
else
    echo "installed: $UNIT (ExecStart=$VENV_TARGET/bin/$NAME), $ETC, $STATE"
    (( ENABLE )) || echo "next: edit $ETC/daemon.toml, then: systemctl enable --now $NAME"
fi
