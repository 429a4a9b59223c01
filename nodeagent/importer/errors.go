package importer

import (
	"context"
	"errors"
	"fmt"

	"github.com/nodevirt/nodevirt/clusterbrain/kit/reach"
)

// Reason is a short CamelCase word that says why an import failed. It is
// meant to be used unchanged as the reason of a DataVolume condition.
type Reason string

const (
	// ReasonInvalidRequest: the Request itself is wrong (no source, no
	// capacity, bad checksum syntax, ...).
	ReasonInvalidRequest Reason = "InvalidRequest"
	// ReasonSourceUnreachable: the source could not be reached or answered
	// with a server error, after the retries.
	ReasonSourceUnreachable Reason = "SourceUnreachable"
	// ReasonNetworkNotAllowed: the source (or a redirect) resolves to an
	// address imports may not reach (loopback, link-local, this node).
	ReasonNetworkNotAllowed Reason = "ImportNetworkNotAllowed"
	// ReasonSourceNotFound: the server answered 404 (or the registry has no
	// such repository, tag or blob).
	ReasonSourceNotFound Reason = "SourceNotFound"
	// ReasonUnauthorized: the server refused the credentials (401/403).
	ReasonUnauthorized Reason = "Unauthorized"
	// ReasonSourceChanged: the source changed between a dropped connection
	// and its resumption.
	ReasonSourceChanged Reason = "SourceChanged"
	// ReasonChecksumMismatch: the downloaded bytes do not match the
	// requested checksum or the registry digest.
	ReasonChecksumMismatch Reason = "ChecksumMismatch"
	// ReasonTruncated: the image ended before its format says it should.
	ReasonTruncated Reason = "ImageTruncated"
	// ReasonInvalidImage: the image is corrupt, or its container (tar,
	// compression) is.
	ReasonInvalidImage Reason = "InvalidImage"
	// ReasonUnsupportedImage: the image is valid but uses something the
	// importer does not handle (backing file, encryption, ...).
	ReasonUnsupportedImage Reason = "UnsupportedImage"
	// ReasonTooLarge: the image's virtual size, or its decompressed stream,
	// is larger than the destination.
	ReasonTooLarge Reason = "ImageTooLarge"
	// ReasonScratchRequired: the image needs random access and the request
	// gave no work directory to download it to.
	ReasonScratchRequired Reason = "ScratchSpaceRequired"
	// ReasonDestination: writing the destination failed.
	ReasonDestination Reason = "DestinationError"
	// ReasonConvert: qemu-img failed on an image it had accepted.
	ReasonConvert Reason = "ConvertFailed"
	// ReasonCanceled: the context was canceled (the DataVolume was deleted).
	ReasonCanceled Reason = "ImportCanceled"
	// ReasonFailed: any other failure.
	ReasonFailed Reason = "ImportFailed"
)

// Error is the error every failed Import returns.
type Error struct {
	Reason Reason
	Err    error
}

func (e *Error) Error() string { return fmt.Sprintf("%s: %v", e.Reason, e.Err) }

func (e *Error) Unwrap() error { return e.Err }

// ReasonOf returns the Reason of err: the Reason of the first *Error in its
// chain, ReasonCanceled for context cancellation, ReasonNetworkNotAllowed
// for a connection the reach policy refused, else ReasonFailed. It is
// "" for a nil err.
func ReasonOf(err error) Reason {
	if err == nil {
		return ""
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return ReasonCanceled
	}
	var ie *Error
	if errors.As(err, &ie) {
		return ie.Reason
	}
	if reach.IsNotAllowed(err) {
		return ReasonNetworkNotAllowed
	}
	return ReasonFailed
}

// failf builds an *Error with a formatted, %w-wrapping message.
func failf(reason Reason, format string, args ...any) *Error {
	return &Error{Reason: reason, Err: fmt.Errorf(format, args...)}
}

// asImportError gives err a Reason if it has none yet.
func asImportError(ctx context.Context, err error) error {
	if err == nil {
		return nil
	}
	if ctx.Err() != nil {
		return &Error{Reason: ReasonCanceled, Err: err}
	}
	var ie *Error
	if errors.As(err, &ie) {
		if _, top := err.(*Error); top {
			return err
		}
		return &Error{Reason: ie.Reason, Err: err}
	}
	return &Error{Reason: ReasonOf(err), Err: err}
}
