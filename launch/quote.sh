# Shell quoting shared by the launchers (sourced, not run): words are
# printed as a POSIX shell reads them back, quoted only when they need it.
# shellcheck shell=bash

# One word.
quote() {
  local s=$1
  if [[ $s =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then
    printf '%s' "$s"
  else
    printf "'%s'" "${s//\'/\'\\\'\'}"
  fi
}

# Several words, space-separated.
quote_all() {
  local out="" word
  for word in "$@"; do
    out+="${out:+ }$(quote "$word")"
  done
  printf '%s' "$out"
}
