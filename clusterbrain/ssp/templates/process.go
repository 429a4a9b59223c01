package templates

import (
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"math/big"
	"regexp"
	"strconv"
	"strings"
)

// Parameter is one parameter of a Template.
type Parameter struct {
	Name        string `json:"name"`
	DisplayName string `json:"displayName,omitempty"`
	Description string `json:"description,omitempty"`
	Value       string `json:"value,omitempty"`
	Generate    string `json:"generate,omitempty"`
	From        string `json:"from,omitempty"`
	Required    bool   `json:"required,omitempty"`
}

// Process resolves tmpl's parameters (a value given in values wins; an
// empty one with generate "expression" is generated from its expression; a
// required one left empty is an error), substitutes ${NAME} in every
// string of the objects and ${{NAME}} as a whole JSON value, adds the
// template's labels to every object, and returns the template with
// the objects and the resolved parameters. Unknown names in values are an
// error, as in oc process.
func Process(tmpl map[string]any, values map[string]string) (map[string]any, error) {
	out := deepCopy(tmpl)
	var params []Parameter
	if raw, ok := out["parameters"]; ok {
		data, err := json.Marshal(raw)
		if err != nil {
			return nil, err
		}
		if err := json.Unmarshal(data, &params); err != nil {
			return nil, fmt.Errorf("parameters: %w", err)
		}
	}
	known := map[string]bool{}
	for _, p := range params {
		known[p.Name] = true
	}
	for k := range values {
		if !known[k] {
			return nil, fmt.Errorf("unknown parameter name %q", k)
		}
	}
	resolved := map[string]string{}
	var errs []error
	for i := range params {
		p := &params[i]
		if v, ok := values[p.Name]; ok {
			p.Value = v
		}
		if p.Value == "" && p.Generate != "" {
			if p.Generate != "expression" {
				errs = append(errs, fmt.Errorf("parameter %s: unknown generator %q", p.Name, p.Generate))
				continue
			}
			v, err := Generate(p.From)
			if err != nil {
				errs = append(errs, fmt.Errorf("parameter %s: %w", p.Name, err))
				continue
			}
			p.Value = v
		}
		if p.Required && p.Value == "" {
			errs = append(errs, fmt.Errorf("parameter %s is required and must be specified", p.Name))
		}
		resolved[p.Name] = p.Value
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	objs, _ := out["objects"].([]any)
	labels, _ := out["labels"].(map[string]any)
	for i, o := range objs {
		sub, err := substitute(o, resolved)
		if err != nil {
			return nil, fmt.Errorf("objects[%d]: %w", i, err)
		}
		if m, ok := sub.(map[string]any); ok && len(labels) > 0 {
			md, _ := m["metadata"].(map[string]any)
			if md == nil {
				md = map[string]any{}
				m["metadata"] = md
			}
			l, _ := md["labels"].(map[string]any)
			if l == nil {
				l = map[string]any{}
				md["labels"] = l
			}
			for k, v := range labels {
				l[k] = v
			}
		}
		objs[i] = sub
	}
	pout := make([]any, 0, len(params))
	for _, p := range params {
		pout = append(pout, p)
	}
	data, err := json.Marshal(pout)
	if err != nil {
		return nil, err
	}
	var decoded []any
	if err := json.Unmarshal(data, &decoded); err != nil {
		return nil, err
	}
	out["parameters"] = decoded
	return out, nil
}

var (
	whole = regexp.MustCompile(`^\$\{\{([a-zA-Z0-9_]+)\}\}$`)
	inner = regexp.MustCompile(`\$\{([a-zA-Z0-9_]+)\}`)
)

func substitute(v any, params map[string]string) (any, error) {
	switch t := v.(type) {
	case string:
		if m := whole.FindStringSubmatch(t); m != nil {
			val, ok := params[m[1]]
			if !ok {
				return t, nil
			}
			var parsed any
			if err := json.Unmarshal([]byte(val), &parsed); err != nil {
				return val, nil
			}
			return parsed, nil
		}
		return inner.ReplaceAllStringFunc(t, func(s string) string {
			name := s[2 : len(s)-1]
			if val, ok := params[name]; ok {
				return val
			}
			return s
		}), nil
	case map[string]any:
		out := make(map[string]any, len(t))
		for k, e := range t {
			nk, err := substitute(k, params)
			if err != nil {
				return nil, err
			}
			ne, err := substitute(e, params)
			if err != nil {
				return nil, err
			}
			out[fmt.Sprint(nk)] = ne
		}
		return out, nil
	case []any:
		out := make([]any, len(t))
		for i, e := range t {
			ne, err := substitute(e, params)
			if err != nil {
				return nil, err
			}
			out[i] = ne
		}
		return out, nil
	}
	return v, nil
}

// MaxGenerated bounds what one expression may generate: a template is a
// user's object, and its expressions must not make the brain build
// arbitrarily large values.
const MaxGenerated = 64 << 10

// Generate expands an OpenShift template expression: literal characters,
// character classes [a-z0-9_] (ranges and single characters, \w \d \a \A
// inside or outside brackets) each optionally repeated {n} times.
func Generate(expr string) (string, error) {
	var b strings.Builder
	for i := 0; i < len(expr); {
		var set []byte
		switch {
		case expr[i] == '[':
			end := strings.IndexByte(expr[i:], ']')
			if end < 0 {
				return "", fmt.Errorf("expression %q: unclosed [", expr)
			}
			var err error
			if set, err = charClass(expr[i+1 : i+end]); err != nil {
				return "", fmt.Errorf("expression %q: %w", expr, err)
			}
			i += end + 1
		case expr[i] == '\\' && i+1 < len(expr):
			set = escapeClass(expr[i+1])
			if set == nil {
				set = []byte{expr[i+1]}
			}
			i += 2
		default:
			set = []byte{expr[i]}
			i++
		}
		n := 1
		if i < len(expr) && expr[i] == '{' {
			end := strings.IndexByte(expr[i:], '}')
			if end < 0 {
				return "", fmt.Errorf("expression %q: unclosed {", expr)
			}
			c, err := strconv.Atoi(expr[i+1 : i+end])
			if err != nil || c < 0 || c > 255 {
				return "", fmt.Errorf("expression %q: bad count %q", expr, expr[i+1:i+end])
			}
			n = c
			i += end + 1
		}
		if b.Len()+n > MaxGenerated {
			return "", fmt.Errorf("expression %q: generates more than %d bytes", expr, MaxGenerated)
		}
		for ; n > 0; n-- {
			k, err := rand.Int(rand.Reader, big.NewInt(int64(len(set))))
			if err != nil {
				return "", err
			}
			b.WriteByte(set[k.Int64()])
		}
	}
	return b.String(), nil
}

func escapeClass(c byte) []byte {
	switch c {
	case 'w':
		return span("a-zA-Z0-9_")
	case 'd':
		return span("0-9")
	case 'a':
		return span("a-zA-Z")
	case 'A':
		return []byte("~!@#$%^&*()-_+={}[]\\|<,>.?/\"';:`")
	}
	return nil
}

func span(s string) []byte {
	set, _ := charClass(s)
	return set
}

func charClass(s string) ([]byte, error) {
	var set []byte
	for i := 0; i < len(s); i++ {
		switch {
		case s[i] == '\\' && i+1 < len(s):
			if e := escapeClass(s[i+1]); e != nil {
				set = append(set, e...)
			} else {
				set = append(set, s[i+1])
			}
			i++
		case i+2 < len(s) && s[i+1] == '-':
			if s[i+2] < s[i] {
				return nil, fmt.Errorf("bad range %s", s[i:i+3])
			}
			for c := s[i]; ; c++ {
				set = append(set, c)
				if c == s[i+2] {
					break
				}
			}
			i += 2
		default:
			set = append(set, s[i])
		}
	}
	if len(set) == 0 {
		return nil, errors.New("empty character class")
	}
	return set, nil
}

func deepCopy(in map[string]any) map[string]any {
	data, err := json.Marshal(in)
	if err != nil {
		panic(fmt.Sprintf("templates: decoded JSON does not encode: %v", err))
	}
	var out map[string]any
	if err := json.Unmarshal(data, &out); err != nil {
		panic(fmt.Sprintf("templates: %v", err))
	}
	return out
}
