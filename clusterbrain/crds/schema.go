// Package crds generates the CustomResourceDefinitions of every kind nodevirt
// serves from the Go types themselves (structural OpenAPI v3 schemas, so the
// API server prunes unknown fields and `kubectl explain` works) and installs
// them with server-side apply: the virt-operator install role.
package crds

import (
	"reflect"
	"strings"

	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// swaggerDocer is implemented by API types that carry their field docs
// (kubevirt.io/api and CDI generate it); its "" key documents the type.
type swaggerDocer interface {
	SwaggerDoc() map[string]string
}

var (
	timeType        = reflect.TypeOf(metav1.Time{})
	microTimeType   = reflect.TypeOf(metav1.MicroTime{})
	durationType    = reflect.TypeOf(metav1.Duration{})
	quantityType    = reflect.TypeOf(resource.Quantity{})
	intOrStringType = reflect.TypeOf(intstr.IntOrString{})
	rawType         = reflect.TypeOf(runtime.RawExtension{})
	objectMetaType  = reflect.TypeOf(metav1.ObjectMeta{})
	typeMetaType    = reflect.TypeOf(metav1.TypeMeta{})
	jsonType        = reflect.TypeOf(apiextensionsv1.JSON{})
	bytesType       = reflect.TypeOf([]byte(nil))
)

// generator turns Go types into structural schemas. Descriptions are kept
// down to maxDocDepth so the largest kinds stay well inside etcd's request
// limit.
type generator struct {
	stack       map[reflect.Type]bool
	maxDocDepth int
}

// Schema returns the structural schema of a root object type (a struct with
// TypeMeta, ObjectMeta, spec and status).
func Schema(t reflect.Type) *apiextensionsv1.JSONSchemaProps {
	g := &generator{stack: map[reflect.Type]bool{}, maxDocDepth: 6}
	s := g.schema(t, 0)
	props := s.Properties
	props["apiVersion"] = apiextensionsv1.JSONSchemaProps{Type: "string",
		Description: "APIVersion defines the versioned schema of this representation of an object."}
	props["kind"] = apiextensionsv1.JSONSchemaProps{Type: "string",
		Description: "Kind is a string value representing the REST resource this object represents."}
	props["metadata"] = apiextensionsv1.JSONSchemaProps{Type: "object"}
	s.Properties = props
	return s
}

func (g *generator) schema(t reflect.Type, depth int) *apiextensionsv1.JSONSchemaProps {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch t {
	case timeType, microTimeType:
		return &apiextensionsv1.JSONSchemaProps{Type: "string", Format: "date-time"}
	case durationType:
		return &apiextensionsv1.JSONSchemaProps{Type: "string"}
	case quantityType:
		return &apiextensionsv1.JSONSchemaProps{XIntOrString: true, AnyOf: []apiextensionsv1.JSONSchemaProps{
			{Type: "integer"}, {Type: "string"}},
			Pattern: `^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$`}
	case intOrStringType:
		return &apiextensionsv1.JSONSchemaProps{XIntOrString: true, AnyOf: []apiextensionsv1.JSONSchemaProps{
			{Type: "integer"}, {Type: "string"}}}
	case rawType, jsonType:
		return &apiextensionsv1.JSONSchemaProps{Type: "object", XPreserveUnknownFields: ptr(true)}
	case objectMetaType:
		// Metadata nested in templates keeps labels, annotations and names.
		return &apiextensionsv1.JSONSchemaProps{Type: "object", XPreserveUnknownFields: ptr(true)}
	case bytesType:
		return &apiextensionsv1.JSONSchemaProps{Type: "string", Format: "byte"}
	}
	switch t.Kind() {
	case reflect.Bool:
		return &apiextensionsv1.JSONSchemaProps{Type: "boolean"}
	case reflect.String:
		return &apiextensionsv1.JSONSchemaProps{Type: "string"}
	case reflect.Int, reflect.Int64, reflect.Uint, reflect.Uint64:
		return &apiextensionsv1.JSONSchemaProps{Type: "integer", Format: "int64"}
	case reflect.Int8, reflect.Int16, reflect.Int32, reflect.Uint8, reflect.Uint16, reflect.Uint32:
		return &apiextensionsv1.JSONSchemaProps{Type: "integer", Format: "int32"}
	case reflect.Float32, reflect.Float64:
		return &apiextensionsv1.JSONSchemaProps{Type: "number"}
	case reflect.Slice, reflect.Array:
		items := g.schema(t.Elem(), depth+1)
		return &apiextensionsv1.JSONSchemaProps{Type: "array",
			Items: &apiextensionsv1.JSONSchemaPropsOrArray{Schema: items}}
	case reflect.Map:
		vals := g.schema(t.Elem(), depth+1)
		return &apiextensionsv1.JSONSchemaProps{Type: "object",
			AdditionalProperties: &apiextensionsv1.JSONSchemaPropsOrBool{Allows: true, Schema: vals}}
	case reflect.Interface:
		return &apiextensionsv1.JSONSchemaProps{XPreserveUnknownFields: ptr(true)}
	case reflect.Struct:
		if g.stack[t] {
			// A recursive type: structural schemas cannot recurse.
			return &apiextensionsv1.JSONSchemaProps{Type: "object", XPreserveUnknownFields: ptr(true)}
		}
		g.stack[t] = true
		defer delete(g.stack, t)
		s := &apiextensionsv1.JSONSchemaProps{Type: "object", Properties: map[string]apiextensionsv1.JSONSchemaProps{}}
		g.fields(t, s, depth)
		return s
	}
	return &apiextensionsv1.JSONSchemaProps{XPreserveUnknownFields: ptr(true)}
}

// fields adds t's JSON fields to s, merging inlined and embedded structs.
func (g *generator) fields(t reflect.Type, s *apiextensionsv1.JSONSchemaProps, depth int) {
	docs := docsOf(t)
	if d := docs[""]; d != "" && depth <= g.maxDocDepth && s.Description == "" {
		s.Description = d
	}
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		if !f.IsExported() {
			continue
		}
		name, opts, _ := strings.Cut(f.Tag.Get("json"), ",")
		if name == "-" {
			continue
		}
		if f.Type == typeMetaType {
			// The root gets apiVersion and kind from Schema; nested
			// objects that embed TypeMeta (a VM's dataVolumeTemplates)
			// keep theirs instead of having them pruned.
			if depth > 0 {
				s.Properties["apiVersion"] = apiextensionsv1.JSONSchemaProps{Type: "string"}
				s.Properties["kind"] = apiextensionsv1.JSONSchemaProps{Type: "string"}
			}
			continue
		}
		if f.Anonymous && (name == "" || strings.Contains(opts, "inline")) {
			ft := f.Type
			for ft.Kind() == reflect.Pointer {
				ft = ft.Elem()
			}
			if ft.Kind() == reflect.Struct && !g.stack[ft] {
				g.stack[ft] = true
				g.fields(ft, s, depth)
				delete(g.stack, ft)
				continue
			}
		}
		if name == "" {
			name = f.Name
		}
		if depth == 0 && name == "metadata" {
			continue
		}
		fs := g.schema(f.Type, depth+1)
		if d := docs[name]; d != "" && depth < g.maxDocDepth {
			fs.Description = d
		}
		s.Properties[name] = *fs
	}
}

func docsOf(t reflect.Type) map[string]string {
	if d, ok := reflect.New(t).Elem().Interface().(swaggerDocer); ok {
		return d.SwaggerDoc()
	}
	if d, ok := reflect.New(t).Interface().(swaggerDocer); ok {
		return d.SwaggerDoc()
	}
	return nil
}

func ptr[T any](v T) *T { return &v }
