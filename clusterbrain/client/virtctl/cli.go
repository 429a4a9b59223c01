package virtctl

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"runtime"
	"runtime/debug"
	"sort"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
	"sigs.k8s.io/yaml"
)

// IO is where a command reads and writes.
type IO struct {
	In       io.Reader
	Out, Err io.Writer
	// load connects to the cluster for a local command that turns out to
	// need it (create vm --template).
	load func() (*Client, error)
}

// command is one verb.
type command struct {
	usage string
	short string
	args  int // positional arguments wanted (-1: any)
	flags func(fs *flag.FlagSet) func(ctx context.Context, c *Client, io IO, args []string) error
	local bool // needs no cluster
}

var commands = map[string]command{
	"start": {usage: "start VM", short: "Start a virtual machine.", args: 1, flags: func(fs *flag.FlagSet) func(context.Context, *Client, IO, []string) error {
		paused := fs.Bool("paused", false, "start the VM paused")
		dry := fs.Bool("dry-run", false, "only validate the request")
		return func(ctx context.Context, c *Client, o IO, a []string) error {
			err := c.VM(ctx, a[0], "start", &kubevirtv1.StartOptions{Paused: *paused, DryRun: dryRun(*dry)})
			return done(o, err, "VM %s was scheduled to start", a[0])
		}
	}},
	"stop": {usage: "stop VM", short: "Stop a virtual machine.", args: 1, flags: func(fs *flag.FlagSet) func(context.Context, *Client, IO, []string) error {
		grace := fs.Int64("grace-period", -1, "seconds the guest gets to shut down (with --force)")
		force := fs.Bool("force", false, "stop immediately, with --grace-period (default 0)")
		dry := fs.Bool("dry-run", false, "only validate the request")
		return func(ctx context.Context, c *Client, o IO, a []string) error {
			opts := &kubevirtv1.StopOptions{DryRun: dryRun(*dry)}
			if *grace != -1 && !*force {
				return errors.New("--grace-period must be used with --force")
			}
			if *force {
				g := max(*grace, 0)
				opts.GracePeriod = &g
			}
			return done(o, c.VM(ctx, a[0], "stop", opts), "VM %s was scheduled to stop", a[0])
		}
	}},
	"restart": {usage: "restart VM", short: "Restart a virtual machine.", args: 1, flags: func(fs *flag.FlagSet) func(context.Context, *Client, IO, []string) error {
		grace := fs.Int64("grace-period", -1, "with --force: 0 restarts immediately")
		force := fs.Bool("force", false, "restart immediately")
		dry := fs.Bool("dry-run", false, "only validate the request")
		return func(ctx context.Context, c *Client, o IO, a []string) error {
			opts := &kubevirtv1.RestartOptions{DryRun: dryRun(*dry)}
			if *force {
				g := max(*grace, 0)
				opts.GracePeriodSeconds = &g
			}
			return done(o, c.VM(ctx, a[0], "restart", opts), "VM %s was scheduled to restart", a[0])
		}
	}},
	"migrate": {usage: "migrate VM", short: "Migrate a running virtual machine to another node.", args: 1, flags: func(fs *flag.FlagSet) func(context.Context, *Client, IO, []string) error {
		dry := fs.Bool("dry-run", false, "only validate the request")
		return func(ctx context.Context, c *Client, o IO, a []string) error {
			return done(o, c.VM(ctx, a[0], "migrate", &kubevirtv1.MigrateOptions{DryRun: dryRun(*dry)}), "VM %s was scheduled to migrate", a[0])
		}
	}},
	"pause": {usage: "pause vm|vmi NAME", short: "Pause a virtual machine (instance).", args: 2, flags: func(fs *flag.FlagSet) func(context.Context, *Client, IO, []string) error {
		dry := fs.Bool("dry-run", false, "only validate the request")
		return func(ctx context.Context, c *Client, o IO, a []string) error {
			if err := vmOrVMI(a[0]); err != nil {
				return err
			}
			return done(o, c.VMI(ctx, a[1], "pause", &kubevirtv1.PauseOptions{DryRun: dryRun(*dry)}), "%s %s was scheduled to pause", strings.ToUpper(a[0]), a[1])
		}
	}},
	"unpause": {usage: "unpause vm|vmi NAME", short: "Unpause a virtual machine (instance).", args: 2, flags: func(fs *flag.FlagSet) func(context.Context, *Client, IO, []string) error {
		dry := fs.Bool("dry-run", false, "only validate the request")
		return func(ctx context.Context, c *Client, o IO, a []string) error {
			if err := vmOrVMI(a[0]); err != nil {
				return err
			}
			return done(o, c.VMI(ctx, a[1], "unpause", &kubevirtv1.UnpauseOptions{DryRun: dryRun(*dry)}), "%s %s was scheduled to unpause", strings.ToUpper(a[0]), a[1])
		}
	}},
	"soft-reboot": {usage: "soft-reboot VMI", short: "Soft reboot a virtual machine instance.", args: 1, flags: func(fs *flag.FlagSet) func(context.Context, *Client, IO, []string) error {
		return func(ctx context.Context, c *Client, o IO, a []string) error {
			return done(o, c.VMI(ctx, a[0], "softreboot", nil), "VMI %s was scheduled to softreboot", a[0])
		}
	}},
	"guestosinfo": guestCommand("guestosinfo", &kubevirtv1.VirtualMachineInstanceGuestAgentInfo{}),
	"userlist":    guestCommand("userlist", &kubevirtv1.VirtualMachineInstanceGuestOSUserList{}),
	"fslist":      guestCommand("filesystemlist", &kubevirtv1.VirtualMachineInstanceFileSystemList{}),
	"console": {usage: "console VMI", short: "Connect to the serial console of a virtual machine instance.", args: 1, flags: func(fs *flag.FlagSet) func(context.Context, *Client, IO, []string) error {
		timeout := fs.Int("timeout", 5, "minutes to wait for the instance to be ready")
		return func(ctx context.Context, c *Client, o IO, a []string) error {
			return Console(ctx, c, a[0], time.Duration(*timeout)*time.Minute, o)
		}
	}},
	"vnc": {usage: "vnc VMI --proxy-only", short: "Open a local VNC proxy to a virtual machine instance.", args: 1, flags: func(fs *flag.FlagSet) func(context.Context, *Client, IO, []string) error {
		proxyOnly := fs.Bool("proxy-only", false, "only run the proxy and print its port (no viewer is started)")
		port := fs.Int("port", 0, "local port (0 picks one)")
		address := fs.String("address", "127.0.0.1", "local listen address")
		return func(ctx context.Context, c *Client, o IO, a []string) error {
			if !*proxyOnly {
				return errors.New("starting a VNC viewer is not supported: use --proxy-only and point a viewer at the printed port")
			}
			ln, err := net.Listen("tcp", net.JoinHostPort(*address, strconv.Itoa(*port)))
			if err != nil {
				return fmt.Errorf("vnc: %w", err)
			}
			return VNCProxy(ctx, c, a[0], ln, o)
		}
	}},
	"version": {usage: "version", short: "Print the client and server versions.", args: 0, flags: func(fs *flag.FlagSet) func(context.Context, *Client, IO, []string) error {
		return func(ctx context.Context, c *Client, o IO, _ []string) error {
			fmt.Fprintf(o.Out, "Client Version: %s\n", clientVersion())
			var info map[string]any
			if err := c.Version(ctx, &info); err != nil {
				return fmt.Errorf("server version: %w", err)
			}
			data, _ := json.Marshal(info)
			fmt.Fprintf(o.Out, "Server Version: %s\n", data)
			return nil
		}
	}},
	"image-upload": {usage: "image-upload dv NAME --size=SIZE --image-path=PATH", short: "Upload a VM image to a DataVolume.", args: 2, flags: func(fs *flag.FlagSet) func(context.Context, *Client, IO, []string) error {
		var u UploadOptions
		fs.StringVar(&u.Size, "size", "", "size of the DataVolume to create (e.g. 10Gi)")
		fs.StringVar(&u.ImagePath, "image-path", "", "path to the local VM image")
		fs.StringVar(&u.StorageClass, "storage-class", "", "storage class of the DataVolume")
		fs.StringVar(&u.UploadProxyURL, "uploadproxy-url", "", "URL of the upload proxy (default from CDIConfig)")
		fs.BoolVar(&u.Insecure, "insecure", false, "do not verify the upload proxy's certificate")
		fs.BoolVar(&u.NoCreate, "no-create", false, "upload into an existing DataVolume")
		fs.UintVar(&u.WaitSecs, "wait-secs", 300, "seconds to wait for the upload target")
		return func(ctx context.Context, c *Client, o IO, a []string) error {
			u.Kind, u.Name, u.Out, u.Progress = a[0], a[1], o.Out, o.Err
			return c.ImageUpload(ctx, u)
		}
	}},
	"create": {usage: "create vm --name=NAME [--memory=128Mi] [--run-strategy=Always] | create vm --template=[NS/]NAME [-p KEY=VALUE]... [--create]",
		short: "Print a VirtualMachine manifest, or the VM a template (template.openshift.io) makes.", args: 1, local: true, flags: func(fs *flag.FlagSet) func(context.Context, *Client, IO, []string) error {
			name := fs.String("name", "", "name of the VM (default: generated)")
			memory := fs.String("memory", "128Mi", "guest memory")
			strategy := fs.String("run-strategy", string(kubevirtv1.RunStrategyAlways), "Always, Halted, Manual, RerunOnFailure or Once")
			instancetype := fs.String("instancetype", "", "cluster instance type to use instead of --memory")
			pvc := fs.String("volume-pvc", "", "PVC to boot from (name)")
			containerDisk := fs.String("volume-containerdisk", "", "container disk image to boot from")
			tmpl := fs.String("template", "", "process this template (NAMESPACE/NAME, or NAME in the current namespace) instead")
			values := params{}
			fs.Var(values, "p", "template parameter KEY=VALUE (repeatable)")
			createIt := fs.Bool("create", false, "with --template: create the VM instead of printing it")
			return func(ctx context.Context, _ *Client, o IO, a []string) error {
				if a[0] != "vm" {
					return fmt.Errorf("create %s: only vm is supported", a[0])
				}
				if *tmpl != "" {
					c, err := o.load()
					if err != nil {
						return err
					}
					return c.createFromTemplate(ctx, o, *tmpl, *name, values, *createIt)
				}
				if len(values) > 0 || *createIt {
					return errors.New("create vm: -p and --create need --template")
				}
				vm, err := NewVM(*name, *memory, *strategy, *instancetype, *pvc, *containerDisk)
				if err != nil {
					return err
				}
				data, err := yaml.Marshal(vm)
				if err != nil {
					return err
				}
				_, err = o.Out.Write(data)
				return err
			}
		}},
}

func init() { commands["softreboot"] = commands["soft-reboot"] } // both spellings

func guestCommand(action string, into any) command {
	return command{usage: action + " VMI", short: "Print guest agent " + action + " as JSON.", args: 1,
		flags: func(fs *flag.FlagSet) func(context.Context, *Client, IO, []string) error {
			return func(ctx context.Context, c *Client, o IO, a []string) error {
				if err := c.GuestInfo(ctx, a[0], action, into); err != nil {
					return err
				}
				data, err := json.MarshalIndent(into, "", "  ")
				if err != nil {
					return err
				}
				fmt.Fprintln(o.Out, string(data))
				return nil
			}
		}}
}

func dryRun(on bool) []string {
	if on {
		return []string{metav1.DryRunAll}
	}
	return nil
}

func vmOrVMI(kind string) error {
	if kind != "vm" && kind != "vmi" {
		return fmt.Errorf("unsupported resource type %q: use vm or vmi", kind)
	}
	return nil
}

func done(o IO, err error, format string, a ...any) error {
	if err != nil {
		return err
	}
	fmt.Fprintf(o.Out, format+"\n", a...)
	return nil
}

// NewVM builds the manifest "create vm" prints.
func NewVM(name, memory, strategy, instancetype, pvc, containerDisk string) (*kubevirtv1.VirtualMachine, error) {
	if name == "" {
		name = fmt.Sprintf("vm-%d", time.Now().Unix()%100000)
	}
	rs := kubevirtv1.VirtualMachineRunStrategy(strategy)
	switch rs {
	case kubevirtv1.RunStrategyAlways, kubevirtv1.RunStrategyHalted, kubevirtv1.RunStrategyManual, kubevirtv1.RunStrategyRerunOnFailure, kubevirtv1.RunStrategyOnce:
	default:
		return nil, fmt.Errorf("invalid run strategy %q", strategy)
	}
	vm := &kubevirtv1.VirtualMachine{
		TypeMeta:   metav1.TypeMeta{APIVersion: kubevirtv1.GroupVersion.String(), Kind: "VirtualMachine"},
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: kubevirtv1.VirtualMachineSpec{RunStrategy: &rs, Template: &kubevirtv1.VirtualMachineInstanceTemplateSpec{
			Spec: kubevirtv1.VirtualMachineInstanceSpec{Domain: kubevirtv1.DomainSpec{}},
		}},
	}
	if instancetype != "" {
		vm.Spec.Instancetype = &kubevirtv1.InstancetypeMatcher{Name: instancetype}
	} else {
		q, err := resource.ParseQuantity(memory)
		if err != nil {
			return nil, fmt.Errorf("invalid memory %q: %w", memory, err)
		}
		vm.Spec.Template.Spec.Domain.Memory = &kubevirtv1.Memory{Guest: &q}
	}
	switch {
	case pvc != "":
		vm.Spec.Template.Spec.Volumes = []kubevirtv1.Volume{{Name: "rootdisk", VolumeSource: kubevirtv1.VolumeSource{
			PersistentVolumeClaim: &kubevirtv1.PersistentVolumeClaimVolumeSource{PersistentVolumeClaimVolumeSource: corev1.PersistentVolumeClaimVolumeSource{ClaimName: pvc}}}}}
	case containerDisk != "":
		vm.Spec.Template.Spec.Volumes = []kubevirtv1.Volume{{Name: "rootdisk", VolumeSource: kubevirtv1.VolumeSource{
			ContainerDisk: &kubevirtv1.ContainerDiskSource{Image: containerDisk}}}}
	}
	return vm, nil
}

// Run executes virtctl with args (without the program name) and returns
// the exit code.
func Run(ctx context.Context, args []string, o IO) int {
	if err := run(ctx, args, o); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		fmt.Fprintln(o.Err, "Error:", err)
		return 1
	}
	return 0
}

func run(ctx context.Context, args []string, o IO) error {
	var g Options
	rest, err := globalFlags(args, &g)
	if err != nil {
		return err
	}
	if len(rest) == 0 || rest[0] == "help" || rest[0] == "-h" || rest[0] == "--help" {
		usage(o.Out)
		return nil
	}
	if rest[0] == "completion" {
		return Completion(o.Out, rest[1:])
	}
	cmd, ok := commands[rest[0]]
	if !ok {
		usage(o.Err)
		return fmt.Errorf("unknown command %q", rest[0])
	}
	fs := flag.NewFlagSet(rest[0], flag.ContinueOnError)
	fs.SetOutput(o.Err)
	exec := cmd.flags(fs)
	fs.Usage = func() {
		fmt.Fprintf(o.Err, "%s\n\nUsage:\n  virtctl %s [flags]\n\nFlags:\n", cmd.short, cmd.usage)
		fs.PrintDefaults()
	}
	pos, err := parseInterspersed(fs, rest[1:])
	if err != nil {
		return err
	}
	if cmd.args >= 0 && len(pos) != cmd.args {
		fs.Usage()
		return fmt.Errorf("%s: want %d argument(s), got %d", rest[0], cmd.args, len(pos))
	}
	var c *Client
	o.load = func() (*Client, error) { return Load(g) }
	if !cmd.local {
		if c, err = Load(g); err != nil {
			return err
		}
	}
	return exec(ctx, c, o, pos)
}

// globalFlags takes kubectl's connection flags from anywhere in args.
func globalFlags(args []string, g *Options) ([]string, error) {
	var rest []string
	for i := 0; i < len(args); i++ {
		a := args[i]
		name, value, hasValue := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if !strings.HasPrefix(a, "-") {
			rest = append(rest, a)
			continue
		}
		var dst *string
		switch name {
		case "kubeconfig":
			dst = &g.Kubeconfig
		case "context":
			dst = &g.Context
		case "n", "namespace":
			dst = &g.Namespace
		default:
			rest = append(rest, a)
			continue
		}
		if !hasValue {
			if i+1 >= len(args) {
				return nil, fmt.Errorf("flag %s needs a value", a)
			}
			i++
			value = args[i]
		}
		*dst = value
	}
	return rest, nil
}

// parseInterspersed lets flags follow positional arguments, as cobra does.
func parseInterspersed(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		args = fs.Args()
		if len(args) == 0 {
			return pos, nil
		}
		pos = append(pos, args[0])
		args = args[1:]
	}
}

func names() []string {
	var ns []string
	for n := range commands {
		ns = append(ns, n)
	}
	ns = append(ns, "completion")
	sort.Strings(ns)
	return ns
}

func usage(w io.Writer) {
	fmt.Fprintln(w, "virtctl controls virtual machine related operations on your kubernetes cluster.\n\nAvailable Commands:")
	for _, n := range names() {
		short := "Print a shell completion script (bash, zsh)."
		if c, ok := commands[n]; ok {
			short = c.short
		}
		fmt.Fprintf(w, "  %-14s %s\n", n, short)
	}
	fmt.Fprintln(w, "\nGlobal flags: --kubeconfig PATH, --context NAME, -n/--namespace NAME")
}

// Completion prints a completion script for shell.
func Completion(w io.Writer, args []string) error {
	shell := "bash"
	if len(args) > 0 {
		shell = args[0]
	}
	words := strings.Join(names(), " ")
	switch shell {
	case "bash":
		fmt.Fprintf(w, `# bash completion for virtctl
_virtctl() {
  local cur=${COMP_WORDS[COMP_CWORD]}
  if [ "$COMP_CWORD" -eq 1 ]; then
    COMPREPLY=($(compgen -W "%s" -- "$cur"))
    return
  fi
  case ${COMP_WORDS[1]} in
    pause|unpause) [ "$COMP_CWORD" -eq 2 ] && { COMPREPLY=($(compgen -W "vm vmi" -- "$cur")); return; } ;;
    image-upload) [ "$COMP_CWORD" -eq 2 ] && { COMPREPLY=($(compgen -W "dv" -- "$cur")); return; } ;;
    create) [ "$COMP_CWORD" -eq 2 ] && { COMPREPLY=($(compgen -W "vm" -- "$cur")); return; } ;;
  esac
  COMPREPLY=($(compgen -W "$(kubectl get vmi -o name 2>/dev/null | sed 's|.*/||') $(kubectl get vm -o name 2>/dev/null | sed 's|.*/||')" -- "$cur"))
}
complete -F _virtctl virtctl
`, words)
	case "zsh":
		fmt.Fprintf(w, "#compdef virtctl\n_arguments '1:command:(%s)' '*::arg:_files'\n", words)
	default:
		return fmt.Errorf("completion: unsupported shell %q (bash, zsh)", shell)
	}
	return nil
}

func clientVersion() string {
	v := "v0.0.0-nodevirt"
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
		v = bi.Main.Version
	}
	return fmt.Sprintf(`version.Info{GitVersion:%q, GoVersion:%q, Platform:"%s/%s"}`, v, runtime.Version(), runtime.GOOS, runtime.GOARCH)
}
