// Package systemd holds nodevirt's systemd deployment: the unit files, the
// configuration files they read (conf/*.conf, installed in /etc/nodevirt),
// nodevirt-certs (the credentials) and the documentation the units name
// (README.md). It has no Go code; its test verifies the units with
// systemd-analyze as `make install-units` lays them out.
package systemd
