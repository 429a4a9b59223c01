package importer

import (
	"bytes"
	"encoding/binary"
)

// Format names a disk image format, as qemu-img spells it where they agree.
type Format string

const (
	FormatRaw   Format = "raw"
	FormatISO   Format = "iso"
	FormatQcow2 Format = "qcow2"
	FormatVMDK  Format = "vmdk"
	FormatVDI   Format = "vdi"
	FormatVHD   Format = "vpc"
	FormatVHDX  Format = "vhdx"
)

// Compression names a stream compression wrapped around an image.
type Compression string

const (
	CompressionNone  Compression = ""
	CompressionGzip  Compression = "gz"
	CompressionXz    Compression = "xz"
	CompressionZstd  Compression = "zstd"
	CompressionBzip2 Compression = "bz2"
)

// sniffLen is how many leading bytes detection looks at: the ISO 9660
// primary volume descriptor sits at 32 KiB.
const sniffLen = 0x8800

var (
	magicGzip = []byte{0x1f, 0x8b}
	magicXz   = []byte{0xfd, '7', 'z', 'X', 'Z', 0x00}
	magicZstd = []byte{0x28, 0xb5, 0x2f, 0xfd}
	// magicBzip2 is "BZh" then the block size digit 1-9.
	magicBzip2 = []byte("BZh")
	magicQcow2 = []byte{'Q', 'F', 'I', 0xfb}
	magicVMDK  = []byte("KDMV")
	magicVHDX  = []byte("vhdxfile")
	magicVHD   = []byte("conectix")
	magicISO   = []byte("CD001")
	// vdiSignature sits little-endian at offset 0x40 of a VDI header.
	vdiSignature uint32 = 0xbeda107f
	// vmdkDescriptor starts a text-only VMDK whose data lives in other
	// files; such an image cannot come over a single stream.
	vmdkDescriptor = []byte("# Disk DescriptorFile")
)

// detectCompression looks at the leading bytes of a stream.
func detectCompression(head []byte) Compression {
	switch {
	case bytes.HasPrefix(head, magicGzip):
		return CompressionGzip
	case bytes.HasPrefix(head, magicXz):
		return CompressionXz
	case bytes.HasPrefix(head, magicZstd):
		return CompressionZstd
	case len(head) >= 4 && bytes.HasPrefix(head, magicBzip2) && head[3] >= '1' && head[3] <= '9':
		return CompressionBzip2
	}
	return CompressionNone
}

// detectFormat looks at the leading bytes of an (uncompressed) image.
// Anything not recognised is raw; a text VMDK descriptor is reported as
// VMDK and refused later.
func detectFormat(head []byte) Format {
	switch {
	case bytes.HasPrefix(head, magicQcow2):
		return FormatQcow2
	case bytes.HasPrefix(head, magicVMDK), bytes.HasPrefix(head, vmdkDescriptor):
		return FormatVMDK
	case bytes.HasPrefix(head, magicVHDX):
		return FormatVHDX
	case bytes.HasPrefix(head, magicVHD):
		return FormatVHD
	case len(head) >= 0x44 && binary.LittleEndian.Uint32(head[0x40:]) == vdiSignature:
		return FormatVDI
	case len(head) >= 0x8006 && bytes.Equal(head[0x8001:0x8006], magicISO):
		return FormatISO
	}
	return FormatRaw
}

// headerVirtualSize reads the virtual size a container format declares in
// its first bytes. ok is false when the format keeps it elsewhere (VHDX
// metadata region) or the header is too short; the size is then checked
// with qemu-img info before converting.
func headerVirtualSize(f Format, head []byte) (size int64, ok bool) {
	switch f {
	case FormatQcow2:
		if len(head) < 32 {
			return 0, false
		}
		return int64(binary.BigEndian.Uint64(head[24:])), true
	case FormatVMDK:
		// Sparse extent header: capacity in 512-byte sectors at 12.
		if len(head) < 20 || !bytes.HasPrefix(head, magicVMDK) {
			return 0, false
		}
		return int64(binary.LittleEndian.Uint64(head[12:])) * 512, true
	case FormatVDI:
		// Header v1.1: disk size at 0x170.
		if len(head) < 0x178 || binary.LittleEndian.Uint32(head[0x44:]) != 0x00010001 {
			return 0, false
		}
		return int64(binary.LittleEndian.Uint64(head[0x170:])), true
	case FormatVHD:
		// A dynamic VHD starts with a copy of its footer: current size at 48.
		if len(head) < 64 {
			return 0, false
		}
		return int64(binary.BigEndian.Uint64(head[48:])), true
	}
	return 0, false
}

// vhdFixedFooterSize recognises the 512-byte footer that ends a fixed VHD
// (which otherwise reads as raw) and returns the disk size it declares.
func vhdFixedFooterSize(footer []byte) (int64, bool) {
	if len(footer) != 512 || !bytes.HasPrefix(footer, magicVHD) {
		return 0, false
	}
	const diskTypeFixed = 2
	if binary.BigEndian.Uint32(footer[60:]) != diskTypeFixed {
		return 0, false
	}
	return int64(binary.BigEndian.Uint64(footer[48:])), true
}
