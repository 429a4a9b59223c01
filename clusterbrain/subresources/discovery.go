package subresources

import (
	"net/http"
	"runtime"
	"runtime/debug"
	"slices"
	"strings"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/kit/httperr"
)

// Info is the version document of /version, shaped like KubeVirt's.
type Info struct {
	GitVersion   string `json:"gitVersion"`
	GitCommit    string `json:"gitCommit"`
	GitTreeState string `json:"gitTreeState"`
	BuildDate    string `json:"buildDate"`
	GoVersion    string `json:"goVersion"`
	Compiler     string `json:"compiler"`
	Platform     string `json:"platform"`
}

// DefaultInfo describes this binary from its build information.
func DefaultInfo() Info {
	info := Info{GitVersion: "v0.0.0-nodevirt", GitTreeState: "clean", GoVersion: runtime.Version(),
		Compiler: runtime.Compiler, Platform: runtime.GOOS + "/" + runtime.GOARCH}
	if bi, ok := debug.ReadBuildInfo(); ok {
		if v := bi.Main.Version; v != "" && v != "(devel)" {
			info.GitVersion = v
		}
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				info.GitCommit = s.Value
			case "vcs.time":
				info.BuildDate = s.Value
			case "vcs.modified":
				if s.Value == "true" {
					info.GitTreeState = "dirty"
				}
			}
		}
	}
	return info
}

// resources lists the subresources served, as virt-api names them in
// discovery: only what has a route, so a client never finds a name that
// answers 404.
func (s *Server) resources() []string {
	var names []string
	for _, rt := range s.routes() {
		name := rt.resource
		if sub := strings.TrimSuffix(rt.sub, "/"); sub != "" {
			name += "/" + sub
		}
		if !slices.Contains(names, name) {
			names = append(names, name)
		}
	}
	return names
}

func apiGroup() metav1.APIGroup {
	g := metav1.APIGroup{
		TypeMeta:                   metav1.TypeMeta{Kind: "APIGroup", APIVersion: "v1"},
		Name:                       Group,
		PreferredVersion:           metav1.GroupVersionForDiscovery{GroupVersion: Group + "/" + Versions[0], Version: Versions[0]},
		ServerAddressByClientCIDRs: []metav1.ServerAddressByClientCIDR{{ClientCIDR: "0.0.0.0/0"}},
	}
	for _, v := range Versions {
		g.Versions = append(g.Versions, metav1.GroupVersionForDiscovery{GroupVersion: Group + "/" + v, Version: v})
	}
	return g
}

// serveDiscovery answers the discovery, version, health and OpenAPI paths;
// it reports whether the request was one of them.
func (s *Server) serveDiscovery(w http.ResponseWriter, r *http.Request) bool {
	if r.Method != http.MethodGet {
		return false
	}
	p := strings.TrimSuffix(r.URL.Path, "/")
	switch p {
	case "":
		paths := []string{"/apis", "/openapi/v2"}
		for _, v := range Versions {
			paths = append(paths, "/apis/"+Group, "/apis/"+Group+"/"+v)
		}
		_ = httperr.WriteJSON(w, http.StatusOK, metav1.RootPaths{Paths: paths})
		return true
	case "/apis":
		_ = httperr.WriteJSON(w, http.StatusOK, metav1.APIGroupList{
			TypeMeta: metav1.TypeMeta{Kind: "APIGroupList", APIVersion: "v1"}, Groups: []metav1.APIGroup{apiGroup()}})
		return true
	case "/apis/" + Group:
		_ = httperr.WriteJSON(w, http.StatusOK, apiGroup())
		return true
	case "/healthz":
		s.healthz(w, r)
		return true
	case "/openapi/v2":
		_ = httperr.WriteJSON(w, http.StatusOK, map[string]any{"swagger": "2.0",
			"info": map[string]any{"title": "KubeVirt API", "version": s.cfg.Version.GitVersion}, "paths": map[string]any{}})
		return true
	case "/openapi/v3":
		_ = httperr.WriteJSON(w, http.StatusOK, map[string]any{"paths": map[string]any{}})
		return true
	}
	for _, v := range Versions {
		base := "/apis/" + Group + "/" + v
		switch p {
		case base:
			list := metav1.APIResourceList{TypeMeta: metav1.TypeMeta{Kind: "APIResourceList", APIVersion: "v1"},
				GroupVersion: Group + "/" + v}
			for _, name := range s.resources() {
				list.APIResources = append(list.APIResources, metav1.APIResource{Name: name, Namespaced: true})
			}
			_ = httperr.WriteJSON(w, http.StatusOK, list)
			return true
		case base + "/version":
			_ = httperr.WriteJSON(w, http.StatusOK, s.cfg.Version)
			return true
		case base + "/healthz":
			s.healthz(w, r)
			return true
		}
	}
	return false
}

// healthz answers like virt-api: healthy while kube-apiserver answers.
func (s *Server) healthz(w http.ResponseWriter, r *http.Request) {
	if _, err := s.cfg.Kube.Discovery().RESTClient().Get().AbsPath("/version").DoRaw(r.Context()); err != nil {
		_ = httperr.WriteJSON(w, http.StatusInternalServerError, map[string]string{"apiserver": "failed", "error": err.Error()})
		return
	}
	_ = httperr.WriteJSON(w, http.StatusOK, map[string]string{"apiserver": "ok", "restcontrollers": "ok"})
}
