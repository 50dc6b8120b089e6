package core

import (
	"fmt"
	"math"
)

// Capacity is what the host can give guests: its CPUs times the vCPU
// overcommit ratio less the vCPUs kept back, and its memory less the memory
// kept back. Memory is never overcommitted: each instance counts its guest
// RAM plus QEMU's own overhead.
type Capacity struct {
	HostCPUs          int     // online CPUs
	HostMemoryMiB     int     // MemTotal
	ReserveVCPU       int     // HOST_RESERVE_VCPU
	ReserveMemoryMiB  int     // HOST_RESERVE_MEMORY_MB
	CPUOvercommit     float64 // CPU_OVERCOMMIT (1 when unset)
	PerGuestOverhead  int     // MiB of QEMU beyond guest RAM, counted per instance
	MaxInstanceMemory int     // optional cap per instance, 0 for none
}

// Usage is vCPUs and memory in use or asked for.
type Usage struct {
	VCPUs     int
	MemoryMiB int
}

// Limits returns the totals guests may use.
func (c Capacity) Limits() Usage {
	ratio := c.CPUOvercommit
	if ratio <= 0 {
		ratio = 1
	}
	cpus := int(math.Floor(float64(c.HostCPUs-c.ReserveVCPU) * ratio))
	if cpus < 0 {
		cpus = 0
	}
	mem := c.HostMemoryMiB - c.ReserveMemoryMiB
	if mem < 0 {
		mem = 0
	}
	return Usage{VCPUs: cpus, MemoryMiB: mem}
}

// Charge is what one instance of vcpus and memoryMiB counts against the
// limits.
func (c Capacity) Charge(vcpus, memoryMiB int) Usage {
	return Usage{VCPUs: vcpus, MemoryMiB: memoryMiB + c.PerGuestOverhead}
}

// InsufficientCapacityError says what ran out.
type InsufficientCapacityError struct {
	Resource        string // "vCPUs" or "memory"
	Want, Free, Max int
}

func (e *InsufficientCapacityError) Error() string {
	unit := ""
	if e.Resource == "memory" {
		unit = " MiB"
	}
	return fmt.Sprintf("insufficient capacity: the instance needs %d%s of %s, %d%s of %d%s are free on this host",
		e.Want, unit, e.Resource, e.Free, unit, e.Max, unit)
}

// Admit checks that an instance charging want fits next to used.
func (c Capacity) Admit(used, want Usage) error {
	lim := c.Limits()
	if want.VCPUs > lim.VCPUs-used.VCPUs {
		return &InsufficientCapacityError{Resource: "vCPUs", Want: want.VCPUs, Free: max(lim.VCPUs-used.VCPUs, 0), Max: lim.VCPUs}
	}
	if want.MemoryMiB > lim.MemoryMiB-used.MemoryMiB {
		return &InsufficientCapacityError{Resource: "memory", Want: want.MemoryMiB, Free: max(lim.MemoryMiB-used.MemoryMiB, 0), Max: lim.MemoryMiB}
	}
	return nil
}
