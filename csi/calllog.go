package csi

import (
	"context"
	"log/slog"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// logCalls is the gRPC interceptor that logs every call: the request with
// its secrets removed at debug level, then the outcome.
func (d *Driver) logCalls(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	start := time.Now()
	if d.log.Enabled(ctx, slog.LevelDebug) {
		d.log.DebugContext(ctx, "csi call", "method", info.FullMethod, "request", redacted(req))
	}
	resp, err := handler(ctx, req)
	took := time.Since(start)
	if d.cfg.ObserveCall != nil {
		d.cfg.ObserveCall(info.FullMethod, status.Code(err), took)
	}
	attrs := []any{"method", info.FullMethod, "duration", took}
	if err != nil {
		st := status.Convert(err)
		d.log.WarnContext(ctx, "csi call failed", append(attrs, "code", st.Code().String(), "err", st.Message())...)
		return resp, err
	}
	d.log.DebugContext(ctx, "csi call done", attrs...)
	return resp, err
}

// redacted renders a request as JSON with every "secrets" field emptied,
// at any depth.
func redacted(req any) string {
	m, ok := req.(proto.Message)
	if !ok {
		return "<not a protobuf message>"
	}
	c := proto.Clone(m)
	stripSecrets(c.ProtoReflect())
	b, err := protojson.Marshal(c)
	if err != nil {
		return "<unprintable: " + err.Error() + ">"
	}
	return string(b)
}

func stripSecrets(m protoreflect.Message) {
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		switch {
		case fd.Name() == "secrets":
			m.Clear(fd)
		case fd.IsList() && fd.Message() != nil:
			l := v.List()
			for i := 0; i < l.Len(); i++ {
				stripSecrets(l.Get(i).Message())
			}
		case fd.IsMap() && fd.MapValue().Message() != nil:
			v.Map().Range(func(_ protoreflect.MapKey, mv protoreflect.Value) bool {
				stripSecrets(mv.Message())
				return true
			})
		case fd.Message() != nil && !fd.IsMap():
			stripSecrets(v.Message())
		}
		return true
	})
}
