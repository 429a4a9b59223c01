package launcher

import (
	"encoding/json"
	"reflect"
	"testing"
)

// TestGuestInterfaces reads an answer of qemu-ga's
// guest-network-get-interfaces (as Debian's 7.2 agent writes it).
func TestGuestInterfaces(t *testing.T) {
	const answer = `[
	 {"name":"lo","hardware-address":"00:00:00:00:00:00","ip-addresses":[
	   {"ip-address-type":"ipv4","ip-address":"127.0.0.1","prefix":8},{"ip-address-type":"ipv6","ip-address":"::1","prefix":128}]},
	 {"name":"eth0","hardware-address":"02:00:5E:4E:56:01","ip-addresses":[
	   {"ip-address-type":"ipv6","ip-address":"fe80::5eff:fe4e:5601","prefix":64},
	   {"ip-address-type":"ipv6","ip-address":"fd00::5","prefix":64},
	   {"ip-address-type":"ipv4","ip-address":"10.231.0.5","prefix":24}],
	  "statistics":{"rx-bytes":0}},
	 {"name":"eth1","hardware-address":"02:00:5e:4e:56:02"}]`
	var ifs []agentInterface
	if err := json.Unmarshal([]byte(answer), &ifs); err != nil {
		t.Fatal(err)
	}
	got := guestInterfaces(ifs)
	want := []GuestInterface{
		{Name: "eth0", MAC: "02:00:5e:4e:56:01", IP: "10.231.0.5", IPs: []string{"fd00::5", "10.231.0.5"}},
		{Name: "eth1", MAC: "02:00:5e:4e:56:02"},
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("got %+v\nwant %+v", got, want)
	}
}
