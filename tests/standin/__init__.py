"""Test-only stand-ins of the Biren vendor libraries (no SUPA card here): they
let the plugin's ``supa`` path run on the host."""
