// RUN: hspmd-opt %s | hspmd-opt | filecheck %s

// Physical IR prints and parses back: one nested module per device group with its
// `hspmd.devices`, local shapes, layouts only in `global_type`, and every comm op (groups,
// dims, root, pairs) with its local shapes.

builtin.module {
  builtin.module @group0 attributes {hspmd.devices = #dist.devices<"0-3">} {
    func.func @train_step() {
      %w = graph.parameter "w" {init = "zeros", global_type = tensor<8x6xf32, #dist.layout<"[0-3]: dup=4">>} : tensor<8x6xf32>
      %x = graph.input "x" {global_type = tensor<16x6xf32, #dist.layout<"[0-3]: split(0)=4">>} : tensor<4x6xf32>
      %a = comm.all_reduce %w {groups = #dist.groups<"[2,2]<=[4]">} : tensor<8x6xf32> -> tensor<8x6xf32>
      %b = comm.broadcast %a {groups = #dist.groups<"{0-3}">, root = 0 : i64} : tensor<8x6xf32> -> tensor<8x6xf32>
      %g = comm.all_gather %x {groups = #dist.groups<"{0,2},{1,3}">, dim = 0 : i64} : tensor<4x6xf32> -> tensor<8x6xf32>
      %rs = comm.reduce_scatter %b {groups = #dist.groups<"[2,2]<=[4]">, dim = 1 : i64} : tensor<8x6xf32> -> tensor<8x3xf32>
      %ls = comm.local_split %g {groups = #dist.groups<"[2,2]<=[4]">, dim = 1 : i64} : tensor<8x6xf32> -> tensor<8x3xf32>
      %z = comm.local_zero %ls {groups = #dist.groups<"{0-3}">} : tensor<8x3xf32> -> tensor<8x3xf32>
      %t = comm.all_to_all %z {groups = #dist.groups<"[2,2]<=[4]">, split_dim = 0 : i64, concat_dim = 1 : i64} : tensor<8x3xf32> -> tensor<4x6xf32>
      comm.send %t {pairs = #dist.pairs<"0,1->2,3">} : tensor<4x6xf32>
      %r = comm.recv {pairs = #dist.pairs<"0,1->2,3">} : tensor<4x6xf32>
      %s = graph.add %t, %r : (tensor<4x6xf32>, tensor<4x6xf32>) -> tensor<4x6xf32>
      graph.assign "w", %a : tensor<8x6xf32>
      func.return
    }
  }
  builtin.module @group1 attributes {hspmd.devices = #dist.devices<"4">} {
    func.func @train_step() {
      %w = graph.parameter "w" {init = "ones", global_type = tensor<8x6xf32, #dist.layout<"[0-3]: dup=4 | [4]: dup=1 ; hetero=dup">>} : tensor<8x6xf32>
      func.return
    }
  }
}

// CHECK:     builtin.module {
// CHECK-NEXT:  builtin.module @group0 attributes {hspmd.devices = #dist.devices<"0-3">} {
// CHECK-NEXT:    func.func @train_step() {
// CHECK-NEXT:      %w = graph.parameter "w" {init = "zeros", global_type = tensor<8x6xf32, #dist.layout<"[0-3]: dup=4">>} : tensor<8x6xf32>
// CHECK-NEXT:      %x = graph.input "x" {global_type = tensor<16x6xf32, #dist.layout<"[0-3]: split(0)=4">>} : tensor<4x6xf32>
// CHECK-NEXT:      %a = comm.all_reduce %w {groups = #dist.groups<"[2,2]<=[4]">} : tensor<8x6xf32> -> tensor<8x6xf32>
// CHECK-NEXT:      %b = comm.broadcast %a {groups = #dist.groups<"{0-3}">, root = 0 : i64} : tensor<8x6xf32> -> tensor<8x6xf32>
// CHECK-NEXT:      %g = comm.all_gather %x {groups = #dist.groups<"{0,2},{1,3}">, dim = 0 : i64} : tensor<4x6xf32> -> tensor<8x6xf32>
// CHECK-NEXT:      %rs = comm.reduce_scatter %b {groups = #dist.groups<"[2,2]<=[4]">, dim = 1 : i64} : tensor<8x6xf32> -> tensor<8x3xf32>
// CHECK-NEXT:      %ls = comm.local_split %g {groups = #dist.groups<"[2,2]<=[4]">, dim = 1 : i64} : tensor<8x6xf32> -> tensor<8x3xf32>
// CHECK-NEXT:      %z = comm.local_zero %ls {groups = #dist.groups<"{0-3}">} : tensor<8x3xf32> -> tensor<8x3xf32>
// CHECK-NEXT:      %t = comm.all_to_all %z {groups = #dist.groups<"[2,2]<=[4]">, split_dim = 0 : i64, concat_dim = 1 : i64} : tensor<8x3xf32> -> tensor<4x6xf32>
// CHECK-NEXT:      comm.send %t {pairs = #dist.pairs<"0,1->2,3">} : tensor<4x6xf32>
// CHECK-NEXT:      %r = comm.recv {pairs = #dist.pairs<"0,1->2,3">} : tensor<4x6xf32>
// CHECK-NEXT:      %s = graph.add %t, %r : (tensor<4x6xf32>, tensor<4x6xf32>) -> tensor<4x6xf32>
// CHECK-NEXT:      graph.assign "w", %a : tensor<8x6xf32>
// CHECK-NEXT:      func.return
// CHECK-NEXT:    }
// CHECK-NEXT:  }
// CHECK-NEXT:  builtin.module @group1 attributes {hspmd.devices = #dist.devices<"4">} {
// CHECK-NEXT:    func.func @train_step() {
// CHECK-NEXT:      %w = graph.parameter "w" {init = "ones", global_type = tensor<8x6xf32, #dist.layout<"[0-3]: dup=4 | [4]: dup=1 ; hetero=dup">>} : tensor<8x6xf32>
// CHECK-NEXT:      func.return
// CHECK-NEXT:    }
// CHECK-NEXT:  }
// CHECK-NEXT:}
