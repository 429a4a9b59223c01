package upload

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"strconv"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
)

// CDIConfig "config" (cdi.kubevirt.io/v1beta1, cluster scoped) is where
// virtctl image-upload finds the upload proxy when --uploadproxy-url is not
// given: spec.uploadProxyURLOverride, else status.uploadProxyURL. The role
// records its proxy there, leaving an override alone.
const (
	cdiConfigGV   = "cdi.kubevirt.io/v1beta1"
	cdiConfigPath = "/apis/" + cdiConfigGV + "/cdiconfigs/config"
	cdiConfigName = "config"
)

// publishInterval is how often the proxy URL is checked in CDIConfig (the
// API may be installed after the role starts; someone may reset it).
var publishInterval = 15 * time.Second

// ProxyURL is the URL clients reach the upload proxy at: the advertised
// address and the bound port (valid once Run listens).
func (s *Server) ProxyURL() (string, error) {
	if s.proxyLn == nil {
		return "", fmt.Errorf("upload proxy is not listening")
	}
	tcp, ok := s.proxyLn.Addr().(*net.TCPAddr)
	if !ok {
		return "", fmt.Errorf("upload proxy listens on %s, not tcp", s.proxyLn.Addr())
	}
	ip := tcp.IP
	if ip.IsUnspecified() {
		var err error
		if ip, err = s.advertiseIP(); err != nil {
			return "", err
		}
	}
	return "https://" + net.JoinHostPort(ip.String(), strconv.Itoa(tcp.Port)), nil
}

// keepProxyURL publishes the proxy URL now and every publishInterval until
// ctx ends.
func (s *Server) keepProxyURL(ctx context.Context) {
	t := time.NewTicker(publishInterval)
	defer t.Stop()
	logged := false
	for {
		published, err := s.publishProxyURL(ctx)
		switch {
		case err != nil && ctx.Err() == nil:
			s.log.Warn("upload proxy url not recorded in cdiconfig", "err", err)
		case !published && !logged:
			s.log.Info("no cdiconfig api: virtctl image-upload needs --uploadproxy-url")
			logged = true
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// publishProxyURL sets CDIConfig "config" status.uploadProxyURL to the
// proxy's URL, creating the object when missing. It reports false, without
// error, when the API server does not serve CDIConfig.
func (s *Server) publishProxyURL(ctx context.Context) (bool, error) {
	url, err := s.ProxyURL()
	if err != nil {
		return false, err
	}
	if !s.servesCDIConfig() {
		return false, nil
	}
	rc := s.kube.Discovery().RESTClient()
	raw, err := rc.Get().AbsPath(cdiConfigPath).DoRaw(ctx)
	if apierrors.IsNotFound(err) {
		obj := map[string]any{"apiVersion": cdiConfigGV, "kind": "CDIConfig",
			"metadata": map[string]any{"name": cdiConfigName, "labels": map[string]string{"app.kubernetes.io/managed-by": "nodevirt"}},
			"spec":     map[string]any{}}
		body, _ := json.Marshal(obj)
		raw, err = rc.Post().AbsPath("/apis/"+cdiConfigGV+"/cdiconfigs").Body(body).
			SetHeader("Content-Type", "application/json").DoRaw(ctx)
		if apierrors.IsAlreadyExists(err) {
			raw, err = rc.Get().AbsPath(cdiConfigPath).DoRaw(ctx)
		}
	}
	if err != nil {
		return false, fmt.Errorf("cdiconfig %s: %w", cdiConfigName, err)
	}
	var cur struct {
		Status struct {
			UploadProxyURL *string `json:"uploadProxyURL"`
		} `json:"status"`
	}
	if err := json.Unmarshal(raw, &cur); err != nil {
		return false, fmt.Errorf("cdiconfig %s: %w", cdiConfigName, err)
	}
	if p := cur.Status.UploadProxyURL; p != nil && *p == url {
		return true, nil
	}
	patch, _ := json.Marshal(map[string]any{"status": map[string]any{"uploadProxyURL": url}})
	err = rc.Patch(types.MergePatchType).AbsPath(cdiConfigPath, "status").Body(patch).Do(ctx).Error()
	if apierrors.IsNotFound(err) { // a CRD without the status subresource
		err = rc.Patch(types.MergePatchType).AbsPath(cdiConfigPath).Body(patch).Do(ctx).Error()
	}
	if err != nil {
		return false, fmt.Errorf("record upload proxy url in cdiconfig %s: %w", cdiConfigName, err)
	}
	s.log.Info("upload proxy url recorded in cdiconfig", "url", url)
	return true, nil
}

// servesCDIConfig tells whether the API server serves cdiconfigs.
func (s *Server) servesCDIConfig() bool {
	list, err := s.kube.Discovery().ServerResourcesForGroupVersion(cdiConfigGV)
	if err != nil {
		return false
	}
	for _, r := range list.APIResources {
		if r.Name == "cdiconfigs" {
			return true
		}
	}
	return false
}
