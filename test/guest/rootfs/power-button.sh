#!/bin/sh
# Run by busybox acpid when the ACPI power button is pressed.
echo NODEVIRT-ACPI-POWER-BUTTON >/dev/console
exec poweroff
