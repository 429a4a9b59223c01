package csi

import (
	"path/filepath"
	"testing"

	"github.com/kubernetes-csi/csi-test/v5/pkg/sanity"
	"github.com/onsi/ginkgo/v2"
	"github.com/onsi/gomega"
)

// TestSanity runs the CSI sanity suite against the driver on a unix
// socket: once with filesystem volumes, once with block volumes, each
// against its own driver. Ginkgo runs one suite per process, so both are
// registered under one RunSpecs.
func TestSanity(t *testing.T) {
	requireRoot(t)
	var contexts []*sanity.TestContext
	for _, access := range []string{"mount", "block"} {
		_, sock := startDriver(t, testConfig(t))
		dir := t.TempDir()
		cfg := sanity.NewTestConfig()
		cfg.Address = "unix://" + sock
		cfg.TargetPath = filepath.Join(dir, "target")
		cfg.StagingPath = filepath.Join(dir, "staging")
		cfg.TestVolumeAccessType = access
		cfg.TestVolumeSize = 32 << 20
		cfg.TestVolumeExpandSize = 64 << 20
		cfg.TestNodeVolumeAttachLimit = true
		cfg.IdempotentCount = 2
		// Volumes go to the second pool, so pool selection is exercised.
		cfg.TestVolumeParameters = map[string]string{ParamStoragePool: "slow"}
		ginkgo.Describe("access type "+access, func() {
			contexts = append(contexts, sanity.GinkgoTest(&cfg))
		})
	}
	gomega.RegisterFailHandler(ginkgo.Fail)
	ginkgo.RunSpecs(t, "CSI sanity")
	for _, sc := range contexts {
		sc.Finalize()
	}
}
